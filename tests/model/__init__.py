"""Reference models the tests check idempo against.

`reference`: the record of SPEC §2 as a plain in-memory model with an explicit clock, the
oracle of the store model test (tests/test_store_model.py). `backends`: fresh stores per
hypothesis example on every real server, both faces. `protocol`: the record protocol as a
finite transition system and an exhaustive explorer of it (tests/test_protocol_exhaustive.py).
"""
