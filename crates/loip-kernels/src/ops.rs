//! Kernel entry points (to be filled in).
