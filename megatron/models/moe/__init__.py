"""Mixture-of-experts MLPs: the router, the token dispatch, the experts, and the step's routing
statistics (``layer.MoELayer`` is what a transformer layer holds in place of its MLP)."""
