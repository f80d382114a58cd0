"""Migration revisions (a package so that the wheel ships them)."""
