"""What long-running library work needs from its process, whoever started it: clean exits on
signals (`interrupts`), flat resident memory while streaming (`memory`) and progress bars in bytes
(`progress`). The command line uses them, and so do the library's readers, writers and workers."""
