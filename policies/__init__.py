"""Decision functions for speculation depth (and, later, replica counts): pure, testable without Ray."""
