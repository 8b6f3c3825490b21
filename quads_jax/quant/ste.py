"""The straight-through estimator shared by every fake-quant function."""

import jax


@jax.custom_vjp
def straight_through(x: jax.Array, y: jax.Array) -> jax.Array:
    """Returns ``y`` exactly in the forward pass; the gradient flows to ``x`` as identity.

    Exact, unlike ``x + stop_gradient(y - x)``, whose forward value can round away from ``y``.
    ``y`` gets no gradient.
    """
    return y


straight_through.defvjp(lambda x, y: (y, None), lambda _, g: (g, None))
