//! pdsim
