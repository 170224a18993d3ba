"""The shipped policy presets (TOML); this folder is the package `adaptmem.policies` in the wheel."""
