"""The private half of `idempo.writes`: the SQL of each helper as a sans-I/O generator
(`plan`), and the connections they run on (`faces`)."""
