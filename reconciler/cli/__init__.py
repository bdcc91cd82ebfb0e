"""The command line: parsing and one function per command."""
