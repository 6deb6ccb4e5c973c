"""The PyTorch-facing side of a param: autograd hooks, placeholders that stand in for params,
grads waiting beside their slots, the user's optimizer as a view. Imports every wing below."""
