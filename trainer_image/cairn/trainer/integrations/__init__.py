"""Frameworks whose own training loop checkpoints through Cairn's `CheckpointManager`.

Each module adapts one framework's checkpoint hooks to the public manager API
(`save`, `wait_until_staged`, `restore`, `reached_final`) and imports that
framework; nothing here is imported unless a script asks for it.
"""
