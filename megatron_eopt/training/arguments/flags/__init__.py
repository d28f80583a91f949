"""The trainer's flags, one declarative table per concern (see `table.Flag`).

`ALL_TABLES` lists (group title, rows) in the order `--help` shows them; the parser, the
one-line errors about flags that need or exclude others, and the no-effect/refused lines all
come from these rows. Nothing here imports torch or megatron-core.
"""
