"""Fault tests: full disks, file-size limits and killed processes, each in a subprocess where it could crash."""
