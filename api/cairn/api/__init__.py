"""The shared API of Cairn: the TrainingJob models and the pod contract.

Imported by both sides: the operator (which plans children from a
TrainingJob) and the trainer image (which reads the pod environment and
reports status). Nothing in this package imports kopf, a Kubernetes client or
torch.
"""
