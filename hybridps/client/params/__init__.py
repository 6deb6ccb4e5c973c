"""The PyTorch-facing side of a param: registration into chunks, access and values, grads
landing (and waiting beside their slots), managed tensors, autograd hooks, placeholders that
stand in for params, the user's optimizer as a view. Imports every wing below."""
