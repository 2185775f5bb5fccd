"""What every room shares and imports nothing of theirs: the config models, the typed
results, one failure taxonomy with one retry helper, and the rank -> launcher events."""
