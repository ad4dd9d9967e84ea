"""gpuexp inside the trainers people already use: a callback for Lightning
(``gpuexp.integrations.lightning``) and one for HF Trainer (``gpuexp.integrations.transformers``).

Each measures the run in an experiment that deletes nothing, logs each epoch's memory peaks
through the trainer's own logger, and names the epoch, the step and the batch's shapes when the
run runs out of memory. Importing this package imports neither framework; each module imports
its own.
"""
