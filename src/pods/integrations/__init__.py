"""Integrations of PODS into other training libraries (each behind its own optional extra).

``pods.integrations.trl`` needs ``pip install 'pods[trl]'``; it is not imported here so that ``import pods``
never pays for (or requires) TRL.
"""
