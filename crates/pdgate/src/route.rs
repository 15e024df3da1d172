//! The OpenAI routes that go through the PD flow (below `cache` and `pd`, which both use it).

/// The OpenAI routes that go through the PD flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    Chat,
}

impl Route {
    /// The request path, used for both legs.
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }

    /// The endpoint `kvtransfer::checks` validates the body for.
    pub fn check_endpoint(self) -> kvtransfer::checks::Endpoint {
        match self {
            Route::Completions => kvtransfer::checks::Endpoint::Completions,
            Route::Chat => kvtransfer::checks::Endpoint::ChatCompletions,
        }
    }

    /// Metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::Chat => "chat",
        }
    }
}
