"""What the user configures: policies (validated, frozen), the budget, byte units.

The lowest layer but one (only `adaptmem.modes` is below it): it reads no
device and touches no model, so every mistake in a policy, a budget or a size
is refused here, before anything else happens.
"""
