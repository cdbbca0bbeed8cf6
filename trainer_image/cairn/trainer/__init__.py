"""What runs in a TrainingJob's pods besides the checkpoint library: the
launcher's env contract, the status reporter, and the reference trainer."""
