"""Device drivers and one-off analyses run from the repository root (not part of the package).

Python scripts run as modules (``python -m scripts.compare_runs ...``) or with
``PYTHONPATH=$PWD python scripts/<name>.py``; shell scripts with ``bash scripts/<name>.sh``.
"""
