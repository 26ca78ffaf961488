"""The settings: read, checked, and said back in one line when bad."""
