"""The load: verify-then-load of a unified checkpoint into an engine (`loading`), which machine holds which file
of a checkpoint in machine-local folders (`placement`), and reading files another machine holds (`file_service`).
Imports `folder` only, never the save or the write strategies."""
