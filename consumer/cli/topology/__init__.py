"""``consumer topology``: the broker's plan applied, checked and migrated."""
