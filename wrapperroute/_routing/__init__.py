"""The routing core, in the order a call meets it: ``plan`` (what to call: the model's plan, the arguments checked,
the routed call built), ``run`` (enter the wrapper with it; after a fault, the wrapper back to its between-steps
state and the functorch fallback; ``agree``), ``swap`` (the mechanism: the call, the forward swap, entering),
``state`` (every process-wide registry, and the one window onto them). ``unrouted`` says what is said about a
model with no wrapper; ``kept`` reads the contexts of a forward that is swapped out."""
