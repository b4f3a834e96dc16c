"""What the SQL stores share: one dialect file per database (the statements), the
transaction logic that runs a guarded call on a connection, and the SQLAlchemy executor.

    dialect.py      the statements every database shares, as generators of `Statement`s
    postgres.py     PostgreSQL's statements; sqlite.py SQLite's; mysql.py MariaDB's
    transaction.py  transactional and leased mode on a connection, as generators of
                    transaction operations; the units that run them; the driver loop
    sqlalchemy.py   the executor for a SQLAlchemy connection or session, on any dialect
"""
