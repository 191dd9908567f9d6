"""What the JAX and torch backends share: the loss scale's state in
variables of the model (`model.py`, `loss_scaler.py`) and the step's
backend-neutral pieces (`step.py`)."""
