"""The running service: built from the settings, supervised, its workers fed."""
