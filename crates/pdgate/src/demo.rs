//! Demo (pending)
