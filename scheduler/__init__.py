"""gpusched's pure scheduling core: snapshot in, decisions out. No I/O, no clock, no hidden state."""
