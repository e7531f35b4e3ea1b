"""Recording: every answered call reaches the store exactly once. The gateway hands each call's record to the
`Recorder` (`recorder.py`), which writes it to a local journal first (`journal.py`: an append-only file, fsynced
by policy) and to the store in batches, replaying the journal after a crash or while the store is away."""
