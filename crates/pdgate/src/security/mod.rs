//! Edge security, below the shared state that holds it and the HTTP edge that applies it:
//!
//! - [`guard`]: the request-target checks (canonical paths only, no `CONNECT`, no absolute form),
//!   the pass-through allow-list, transfer fields stripped from client bodies, and the
//!   `[security]` section ([`guard::SecurityConfig`]).
//! - [`auth`]: client API keys (constant-time), named clients and their limits.
//! - [`budget`]: the total of request-body bytes being read.
//! - [`tls`]: the listener's certificates (reloaded on change) and the engines' TLS client.

pub(crate) mod auth;
pub(crate) mod budget;
pub(crate) mod guard;
pub(crate) mod tls;
