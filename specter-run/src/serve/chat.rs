//! Chat messages to prompt text with the checkpoint's own Jinja template, rendered as
//! transformers' `apply_chat_template(messages, add_generation_prompt=True)` renders it: blocks
//! trimmed and left-stripped, `raise_exception` and `strftime_now` defined, the tokenizer's
//! special tokens (`bos_token`, `eos_token`, ...) in the context, Python string methods available.

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::Value;

use super::wire::ChatMessage;

const TEMPLATE_NAME: &str = "chat";

/// The special tokens tokenizer_config.json may name, passed to the template under these names.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// Why a bundle's chat template cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("tokenizer_config.json: {0}")]
    Config(String),
    #[error("the chat template does not compile: {0:#}")]
    Compile(JinjaError),
}

/// A compiled chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(&'static str, String)>,
}

impl ChatTemplate {
    /// The template of a checkpoint: `chat_template.jinja` when present, else tokenizer_config's
    /// `chat_template` (a string, or a list of named templates of which "default" is used).
    /// `Ok(None)`: the checkpoint has no template.
    pub fn from_files(
        tokenizer_config: Option<&[u8]>,
        template_file: Option<&[u8]>,
    ) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let config: Value = match tokenizer_config {
            Some(bytes) => serde_json::from_slice(bytes)
                .map_err(|e| ChatTemplateError::Config(format!("invalid JSON: {e}")))?,
            None => Value::Null,
        };
        let source = match template_file {
            Some(bytes) => Some(
                std::str::from_utf8(bytes)
                    .map_err(|_| {
                        ChatTemplateError::Config("chat_template.jinja is not UTF-8".into())
                    })?
                    .to_string(),
            ),
            None => template_from_config(&config)?,
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let special_tokens = SPECIAL_TOKENS
            .iter()
            .filter_map(|&name| token_text(config.get(name)?).map(|t| (name, t)))
            .collect();
        let mut env = Environment::new();
        // As transformers compiles chat templates (jinja2 with these two options).
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(ChatTemplateError::Compile)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(ChatTemplateError::Compile)?;
        Ok(Some(ChatTemplate {
            env,
            special_tokens,
        }))
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, JinjaError> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages).map_err(|e| {
                JinjaError::new(ErrorKind::InvalidOperation, format!("messages: {e}"))
            })?,
        );
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        for (name, text) in &self.special_tokens {
            ctx.insert((*name).into(), Value::String(text.clone()));
        }
        template.render(minijinja::Value::from(minijinja::value::Serde(&ctx)))
    }
}

fn template_from_config(config: &Value) -> Result<Option<String>, ChatTemplateError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => {
            let pick = |wanted: &str| {
                named.iter().find_map(|entry| {
                    (entry.get("name")?.as_str()? == wanted)
                        .then(|| entry.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            pick("default").map(Some).ok_or_else(|| {
                ChatTemplateError::Config(
                    "chat_template lists named templates but none is called \"default\"".into(),
                )
            })
        }
        Some(_) => Err(ChatTemplateError::Config(
            "chat_template must be a string or a list of {name, template}".into(),
        )),
    }
}

/// A special token as tokenizer_config.json writes it: a string, or an AddedToken object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Templates call this to refuse a conversation (roles out of order, for example).
fn raise_exception(message: String) -> Result<minijinja::Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time formatted with the C strftime codes templates
/// use for dates in system prompts.
fn strftime_now(format: String) -> Result<String, JinjaError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, secs) = (now.div_euclid(86_400), now.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[(month - 1) as usize];
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format code %{other}"),
                ))
            }
            None => out.push('%'),
        }
    }
    Ok(out)
}

/// Year, month (1-12) and day (1-31) of a count of days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> ChatMessage {
        ChatMessage {
            role: "user".into(),
            content: text.into(),
            name: None,
        }
    }

    /// The fixtures' templates render exactly what transformers' apply_chat_template rendered
    /// (tests/fixtures/make_chat_golden.py).
    #[test]
    fn fixture_templates_render_as_transformers_does() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let golden: Value =
            serde_json::from_slice(&std::fs::read(fixtures.join("chat_golden.json")).unwrap())
                .unwrap();
        for name in ["qwen2_moe", "deepseek_v2"] {
            let config = std::fs::read(fixtures.join(name).join("tokenizer_config.json")).unwrap();
            let template = ChatTemplate::from_files(Some(&config), None)
                .unwrap()
                .unwrap();
            let cases = golden["fixtures"][name].as_array().unwrap();
            assert!(cases.len() >= 4, "{name}");
            for case in cases {
                let messages: Vec<ChatMessage> = case["messages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| ChatMessage {
                        role: m["role"].as_str().unwrap().into(),
                        content: m["content"].as_str().unwrap().into(),
                        name: None,
                    })
                    .collect();
                assert_eq!(
                    template.render(&messages).unwrap(),
                    case["rendered"].as_str().unwrap(),
                    "{name}: {messages:?}"
                );
            }
        }
    }

    #[test]
    fn dates_follow_the_gregorian_calendar() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn templates_see_special_tokens_python_methods_and_can_refuse() {
        let config = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('only users') }}{% endif %}{{ m.content.strip().upper() }}{{ eos_token }}{% endfor %}",
        });
        let bytes = serde_json::to_vec(&config).unwrap();
        let template = ChatTemplate::from_files(Some(&bytes), None)
            .unwrap()
            .unwrap();
        assert_eq!(template.render(&[user("  hi ")]).unwrap(), "<s>HI</s>");
        let mut other = user("x");
        other.role = "tool".into();
        let err = template.render(&[other]).unwrap_err();
        assert!(format!("{err:#}").contains("only users"), "{err:#}");
    }

    #[test]
    fn a_config_without_a_template_has_none_and_a_broken_one_is_named() {
        assert!(
            ChatTemplate::from_files(Some(b"{\"eos_token\": \"x\"}"), None)
                .unwrap()
                .is_none()
        );
        assert!(ChatTemplate::from_files(None, None).unwrap().is_none());
        assert!(
            ChatTemplate::from_files(Some(b"{\"chat_template\": \"{% if %}\"}"), None).is_err()
        );
        let named = br#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#;
        let t = ChatTemplate::from_files(Some(named), None)
            .unwrap()
            .unwrap();
        assert_eq!(t.render(&[user("x")]).unwrap(), "D");
    }
}
