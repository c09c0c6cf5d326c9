"""The reference application: a small chat service that uses every kind of stream
plait supports (issue 6). A model for users' own services; `plait demo` runs it."""

SCHEMA = "plait_demo"  # where `plait demo` works unless told otherwise (--schema)
