"""Service templates for launchd and systemd, and the OpenBLAS installer (package data)."""
