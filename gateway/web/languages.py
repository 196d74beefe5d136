"""Language codes between LibreTranslate's clients and a model's own: LibreTranslate names languages
by their ISO 639-1 codes ("fr"); a many-to-many model by its tokenizer's codes: M2M100 "fr",
mBART-50 "fr_XX", NLLB "fra_Latn" (ISO 639-3 and a script). `Languages` maps between them for one
model: the target codes its tokenizer has, and the source language its bundle frames every source
with (a language code among the framing's ids), or the pair a config declares for a model without
codes ([gateway] language_pair).
"""

from __future__ import annotations

from dataclasses import dataclass

# LibreTranslate's language codes: (its name, the ISO 639-3 code and script NLLB spells it with).
# Codes outside this table are matched as the model spells them.
LIBRETRANSLATE = {
    "ar": ("Arabic", "arb_Arab"), "az": ("Azerbaijani", "azj_Latn"), "bg": ("Bulgarian", "bul_Cyrl"),
    "bn": ("Bengali", "ben_Beng"), "ca": ("Catalan", "cat_Latn"), "cs": ("Czech", "ces_Latn"),
    "da": ("Danish", "dan_Latn"), "de": ("German", "deu_Latn"), "el": ("Greek", "ell_Grek"),
    "en": ("English", "eng_Latn"), "eo": ("Esperanto", "epo_Latn"), "es": ("Spanish", "spa_Latn"),
    "et": ("Estonian", "est_Latn"), "eu": ("Basque", "eus_Latn"), "fa": ("Persian", "pes_Arab"),
    "fi": ("Finnish", "fin_Latn"), "fr": ("French", "fra_Latn"), "ga": ("Irish", "gle_Latn"),
    "gl": ("Galician", "glg_Latn"), "he": ("Hebrew", "heb_Hebr"), "hi": ("Hindi", "hin_Deva"),
    "hu": ("Hungarian", "hun_Latn"), "id": ("Indonesian", "ind_Latn"), "it": ("Italian", "ita_Latn"),
    "ja": ("Japanese", "jpn_Jpan"), "ko": ("Korean", "kor_Hang"), "lt": ("Lithuanian", "lit_Latn"),
    "lv": ("Latvian", "lvs_Latn"), "ms": ("Malay", "zsm_Latn"), "nb": ("Norwegian Bokmål", "nob_Latn"),
    "nl": ("Dutch", "nld_Latn"), "pl": ("Polish", "pol_Latn"), "pt": ("Portuguese", "por_Latn"),
    "ro": ("Romanian", "ron_Latn"), "ru": ("Russian", "rus_Cyrl"), "sk": ("Slovak", "slk_Latn"),
    "sl": ("Slovenian", "slv_Latn"), "sq": ("Albanian", "als_Latn"), "sv": ("Swedish", "swe_Latn"),
    "th": ("Thai", "tha_Thai"), "tl": ("Tagalog", "tgl_Latn"), "tr": ("Turkish", "tur_Latn"),
    "uk": ("Ukrainian", "ukr_Cyrl"), "ur": ("Urdu", "urd_Arab"), "vi": ("Vietnamese", "vie_Latn"),
    "zh": ("Chinese", "zho_Hans"), "zt": ("Chinese (traditional)", "zho_Hant"),
}
AUTO = "auto"


def client_code(model_code: str) -> str:
    """The LibreTranslate code of a model's code: "fr" for "fr", "fr_XX" and "fra_Latn"; a code with
    no such match stays as the model spells it."""
    for code, (_, nllb) in LIBRETRANSLATE.items():
        if model_code in (code, nllb) or model_code.split("_")[0] == code:
            return code
    return model_code


def language_name(code: str) -> str:
    return LIBRETRANSLATE.get(code, (code, ""))[0]


@dataclass(frozen=True)
class Languages:
    """One model's languages: `targets` (LibreTranslate code -> the model's target code, "" for a
    model that has no codes and declares its one target), and its `source` (LibreTranslate code, or
    None: any), `source_framed` when the bundle frames every source with that language's code."""

    targets: dict[str, str]
    source: str | None
    source_framed: bool

    @classmethod
    def of(cls, codes: dict[str, int], prefix: list[int], pair: str) -> Languages:
        """From a tokenizer's target codes (code -> id) and source framing, or the declared `pair`
        ("SOURCE:TARGET", LibreTranslate codes; "" undeclared)."""
        if codes:
            ids = {i: code for code, i in codes.items()}
            framed = [ids[i] for i in prefix if i in ids]
            targets = {client_code(code): code for code in sorted(codes)}
            return cls(targets, client_code(framed[0]) if framed else None, bool(framed))
        if pair:
            source, _, target = pair.partition(":")
            return cls({target: ""}, source, False)
        return cls({}, None, False)

    def listing(self) -> list[dict]:
        """GET /languages: each source language with the targets it translates to."""
        sources = [self.source] if self.source else sorted(self.targets)
        return [{"code": code, "name": language_name(code), "targets": sorted(self.targets)} for code in sources]

    def target(self, code: str) -> str:
        """The model's code for target `code` ("" for the model's one target); ValueError when it has none."""
        if code in self.targets:
            return self.targets[code]
        if code in self.targets.values() and code:
            return code
        if not self.targets:
            raise ValueError("this model's languages are not declared: set [gateway] language_pair "
                             '(e.g. "en:de") for a model without language codes')
        raise ValueError(f"target {code!r} is not supported; targets: {', '.join(sorted(self.targets))}")

    def check_source(self, code: str) -> None:
        """ValueError when the model cannot translate from `code` (or from `auto`)."""
        if code == AUTO:
            if self.source_framed:
                raise ValueError(f"source {AUTO!r} is not supported: this model translates from {self.source} "
                                 f"(its bundle frames every source with that code); send source {self.source!r}")
            return
        if self.source is not None and client_code(code) != self.source:
            raise ValueError(f"source {code!r} is not supported: this model translates from {self.source}")
