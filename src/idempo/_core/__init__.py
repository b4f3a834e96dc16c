"""The call protocol, with no I/O and no framework: keys and scopes, the record and its
answers, the operations a call yields, the flow that yields them, fingerprints, renewal."""
