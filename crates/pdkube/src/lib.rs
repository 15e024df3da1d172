//! pdkube
