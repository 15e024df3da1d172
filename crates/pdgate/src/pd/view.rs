//! What a request is: read once from the parsed body, before anything is chosen for it.

use kvtransfer::JsonBody;

use crate::error::GatewayError;
pub use crate::route::Route;

/// What routing needs to know about a request, read once from the parsed body.
#[derive(Debug)]
pub(crate) struct RequestView {
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    /// The parameter that makes this a batch (`n` or `prompt`), if any.
    pub(crate) batched: Option<&'static str>,
}

fn field<'a, T: serde::Deserialize<'a>>(
    body: &'a JsonBody,
    key: &'static str,
    what: &str,
) -> Result<Option<T>, GatewayError> {
    match body.get::<Option<T>>(key) {
        None => Ok(None),
        Some(Ok(v)) => Ok(v),
        Some(Err(_)) => Err(GatewayError::bad_request(
            format!("`{key}` must be {what}"),
            Some(key),
        )),
    }
}

impl RequestView {
    pub(crate) fn read(body: &JsonBody, route: Route) -> Result<Self, GatewayError> {
        let model: Option<String> = field(body, "model", "a string")?;
        let stream = field::<bool>(body, "stream", "a boolean")?.unwrap_or(false);
        let n = field::<u64>(body, "n", "a positive integer")?.unwrap_or(1);
        let mut batched = (n > 1).then_some("n");
        if route == Route::Completions
            && let Some(raw) = body.get_raw("prompt")
            && raw.trim_start().starts_with('[')
        {
            let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(raw)
                .map_err(|_| GatewayError::bad_request("`prompt` is not valid", Some("prompt")))?;
            let nested = items
                .first()
                .is_some_and(|i| i.get().starts_with('"') || i.get().starts_with('['));
            if nested && items.len() > 1 {
                batched = Some("prompt");
            }
        }
        Ok(RequestView {
            model,
            stream,
            batched,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn view(body: &str, route: Route) -> Result<RequestView, GatewayError> {
        RequestView::read(
            &JsonBody::parse(Bytes::from(body.to_string())).unwrap(),
            route,
        )
    }

    #[test]
    fn reads_the_request_view() {
        let v = view(
            r#"{"model":"m","stream":true,"prompt":"hi"}"#,
            Route::Completions,
        )
        .unwrap();
        assert_eq!(v.model.as_deref(), Some("m"));
        assert!(v.stream);
        assert_eq!(v.batched, None);
        assert_eq!(
            view(r#"{"prompt":["a","b"]}"#, Route::Completions)
                .unwrap()
                .batched,
            Some("prompt")
        );
        assert_eq!(
            view(r#"{"prompt":[1,2,3]}"#, Route::Completions)
                .unwrap()
                .batched,
            None
        );
        assert_eq!(
            view(r#"{"prompt":[[1,2]]}"#, Route::Completions)
                .unwrap()
                .batched,
            None
        );
        assert_eq!(
            view(r#"{"n":2,"messages":[]}"#, Route::Chat)
                .unwrap()
                .batched,
            Some("n")
        );
        assert!(view(r#"{"stream":null}"#, Route::Chat).is_ok());
        let err = view(r#"{"stream":"yes"}"#, Route::Chat).unwrap_err();
        assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
        assert!(view(r#"{"model":7}"#, Route::Chat).is_err());
    }
}
