"""Counting torch.compile's graph compilations while a manager is open.

A plan change makes torch.compile recompile the code of the blocks whose mode
changed (the mode is a guard); a plan seen before reuses its compiled code.
`CompileCounter` counts the compilations Dynamo starts, in this process, from
the manager's creation to its close, for `summary()["compiles"]`.
"""

from __future__ import annotations

from typing import Any


class CompileCounter:
    def __init__(self) -> None:
        import torch._dynamo  # here, not at module level: `import adaptmem` stays light (it costs ~1 s)

        self._handler = torch._dynamo.callback_handler
        self.count = 0
        self._open = True
        self._handler.register_start_callback(self._started)

    def _started(self, *args: Any) -> None:
        if self._open:
            self.count += 1

    def close(self) -> None:
        if self._open:
            self._open = False
            self._handler.remove_start_callback(self._started)
