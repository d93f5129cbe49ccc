"""Runnable fine-tuning recipes built on hf_dp (``python recipes/<name>.py --help``)."""
