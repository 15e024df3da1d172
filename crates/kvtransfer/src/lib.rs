//! kvtransfer
