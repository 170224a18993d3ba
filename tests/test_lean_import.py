import subprocess
import sys

CODE = """
import sys
import torch
import adaptmem, adaptmem.testing, adaptmem.demo.tiny, adaptmem.demo.__main__
frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torch._dynamo")
heavy = [m for m in frameworks if m in sys.modules]
assert not heavy, heavy
assert not torch.cuda.is_initialized()
print("lean")
"""


def test_import_pulls_no_framework_and_initializes_no_cuda():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"


def test_public_face_is_explicit():
    import adaptmem

    assert sorted(adaptmem.__all__) == sorted(set(adaptmem.__all__))
    for name in adaptmem.__all__:
        assert hasattr(adaptmem, name), name
