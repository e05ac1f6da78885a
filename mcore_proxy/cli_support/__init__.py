"""What a command needs around the library: the shared flags and their spelling table (`flags`),
progress bars in bytes (`progress`), the optional plotting extra (`plotting`), clean exits on
signals (`interrupts`) and flat resident memory for streaming processes (`memory`)."""
