"""The main job and its embedded model, kept out of the core.

finetune.py  `python -m adaptmem.demo`: a fine-tune under memory pressure on a simulated GPU
table.py     `python -m adaptmem.demo modes`: every mode side by side on one step
tiny.py      TinyTransformer, the embedded small model (no download)
"""
