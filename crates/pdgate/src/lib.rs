//! pdgate
