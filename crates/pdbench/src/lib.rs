//! pdbench
