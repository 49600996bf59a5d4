"""Worker functions of the root README's example (import it as ``examples.mymod``)."""

import disco_core as disco


@disco.register_func("mymod.scale")
def scale(x, factor):
    return x * factor
