"""The bench's progress lines, on stderr so that stdout carries only the report: one Notes for
every bench module, so that all its lines count time from the same start."""

from rpmemfs.progress import Notes

note = Notes("bench")
