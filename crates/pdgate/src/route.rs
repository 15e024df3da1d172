//! The OpenAI routes that go through the PD flow (below `cache` and `pd`, which both use it).

use kvtransfer::KvTransferAgent;

/// The OpenAI routes that go through the PD flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses` (OpenAI Responses API)
    Responses,
    /// `POST /v1/messages` (Anthropic Messages API)
    Messages,
}

impl Route {
    /// The request path, used for both legs.
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
        }
    }

    /// The endpoint `kvtransfer::checks` validates the body for (`None`: the engine judges).
    pub fn check_endpoint(self) -> Option<kvtransfer::checks::Endpoint> {
        match self {
            Route::Completions => Some(kvtransfer::checks::Endpoint::Completions),
            Route::Chat => Some(kvtransfer::checks::Endpoint::ChatCompletions),
            Route::Responses | Route::Messages => None,
        }
    }

    /// Metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::Chat => "chat",
            Route::Responses => "responses",
            Route::Messages => "messages",
        }
    }

    /// Whether a prefill of `agent`'s connector can hand this route's KV to a decode: every
    /// connector on completions and chat; on `/v1/responses` and `/v1/messages` only those whose
    /// engines take their transfer fields there too
    /// ([`KvTransferAgent::carries_responses_and_messages`]), so the other connectors' decodes
    /// serve those routes alone.
    pub fn disaggregates(self, agent: &dyn KvTransferAgent) -> bool {
        match self {
            Route::Completions | Route::Chat => true,
            Route::Responses | Route::Messages => agent.carries_responses_and_messages(),
        }
    }

    /// The prefill leg's base body for this route: the connector's rules (`max_tokens` 1,
    /// no streaming, ...) are written for completions and chat; the Responses API bounds its
    /// output with `max_output_tokens` and must neither run in the background nor store its
    /// one-token answer, and the Messages API stops on `stop_sequences`. `None`: `clean` as it is.
    pub fn prefill_base(self, clean: &kvtransfer::JsonBody) -> Option<kvtransfer::JsonBody> {
        match self {
            Route::Completions | Route::Chat => None,
            Route::Responses => {
                let mut body = clean.clone();
                body.set_raw("max_output_tokens", "1");
                body.set_raw("background", "false");
                body.set_raw("store", "false");
                Some(body)
            }
            Route::Messages => {
                let mut body = clean.clone();
                body.remove("stop_sequences");
                Some(body)
            }
        }
    }
}

/// Whether a Responses API request needs state one engine holds (`previous_response_id`, a
/// `conversation`, `background` mode): a prefill elsewhere cannot see it, so the decode serves
/// it alone.
pub fn responses_state(body: &kvtransfer::JsonBody) -> bool {
    let set = |key: &str| body.get_raw(key).is_some_and(|raw| raw.trim() != "null");
    set("previous_response_id")
        || set("conversation")
        || body.get::<bool>("background").and_then(Result::ok) == Some(true)
}
