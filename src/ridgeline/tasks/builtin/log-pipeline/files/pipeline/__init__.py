"""Access-log report: parse -> aggregate -> render (see each module)."""
