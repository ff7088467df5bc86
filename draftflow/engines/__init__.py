"""Engines that run the target: generation (`generation.py`: hf, openai) and hidden-state
capture (`capture.py`). Each engine module is imported only when chosen."""
