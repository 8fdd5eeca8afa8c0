"""One module of trace templates per op topic, named like the op's module."""
