"""SGLang 0.5.23's capture-layer methods per architecture, as data (capture_rules.py holds the logic and the
rules; this is its generated table, split off to keep both modules short). Generated from the tree:
tests/layer_rules_derive.py tables() runs every EntryClass's own method; tests/test_layer_rules.py checks this
against the tree and every citation. Standard library only (shipped to hosts)."""

from __future__ import annotations

# architecture -> rule, per convention (DSPARK: the method SGLang runs, set_dflash_layers_to_capture where the
# model has no set_dspark_layers_to_capture of its own). Generated from the tree: tests/layer_rules_derive.py
# tables(), which runs every EntryClass's own method on each of its CASES.
TABLE = {
"eagle3": {
        "plus_one": """ApertusForCausalLM BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM
            Cosmos3ForConditionalGeneration EmbeddingGemmaModel ExaoneMoEForCausalLM ExaoneMoEForCausalLMMTP
            ExaoneMoeForCausalLM Gemma3ForCausalLM Gemma3ForConditionalGeneration Gemma4AssistantForCausalLM
            Gemma4ForCausalLM Gemma4ForConditionalGeneration Gemma4UnifiedAssistantForCausalLM
            Gemma4UnifiedForConditionalGeneration Glm4MoeForCausalLM Glm4MoeForCausalLMNextN
            Glm5NextForConditionalGeneration IQuestCoderForCausalLM InternLM3ForCausalLM Llama4ForCausalLM
            Llama4ForConditionalGeneration LlamaForCausalLM LlamaForCausalLMEagle LlamaForCausalLMEagle3
            LongcatFlashForCausalLM LongcatFlashForCausalLMNextN MiniMaxM2ForCausalLM
            MiniMaxM3SparseForCausalLM Ministral3ForCausalLM MistralForCausalLM MistralForCausalLMEagle
            Phi3ForCausalLM Qwen2ForCausalLM Qwen2ForCausalLMEagle Qwen2_5_VLForConditionalGeneration
            Qwen3ForCausalLM Qwen3VLForConditionalGeneration SarvamMoEForCausalLM TeleFLMForCausalLM""",
        "deepseek": """DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM DeepseekV3ForCausalLMNextN
            Glm4MoeLiteForCausalLM Glm4MoeLiteForCausalLMNextN Glm5NextForConditionalGenerationNextN
            GlmMoeDsaForCausalLM GlmMoeDsaForCausalLMNextN KimiK25ForConditionalGeneration
            MistralLarge3ForCausalLM MistralLarge3ForCausalLMEagle""",
        "gpt_oss": """GptOssForCausalLM""",
        "plus_one_marks": """InternS1ProForConditionalGeneration InternS2MobiusForConditionalGeneration
            InternS2PreviewForConditionalGeneration MellumForCausalLM Qwen2MoeForCausalLM Qwen3MoeForCausalLM
            Qwen3MoeForCausalLMMTP Qwen3NextForCausalLM Qwen3NextForCausalLMMTP
            Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM Qwen3_5ForConditionalGeneration
            Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration""",
        "outside": """MindSporeForCausalLM""",
        "plus_one_all": """MiniMaxM3SparseForConditionalGeneration""",
    },
    "dflash": {
        "beam": """BeamForCausalLM""",
        "missing_inner": """Cosmos3ForConditionalGeneration Qwen3VLForConditionalGeneration""",
        "plus_one": """DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM DeepseekV3ForCausalLMNextN
            Gemma4AssistantForCausalLM Gemma4ForCausalLM Gemma4ForConditionalGeneration
            Gemma4UnifiedAssistantForCausalLM Gemma4UnifiedForConditionalGeneration Glm4MoeLiteForCausalLM
            Glm4MoeLiteForCausalLMNextN Glm5NextForConditionalGeneration Glm5NextForConditionalGenerationNextN
            GlmMoeDsaForCausalLM GlmMoeDsaForCausalLMNextN GptOssForCausalLM IQuestCoderForCausalLM
            InternLM3ForCausalLM KimiK25ForConditionalGeneration LagunaForCausalLM Lfm2ForCausalLM
            Lfm2MoeForCausalLM Lfm2VlForConditionalGeneration Llama4ForCausalLM LlamaForCausalLM
            LlamaForCausalLMEagle LlamaForCausalLMEagle3 MiMoV2FlashForCausalLM MiMoV2ForCausalLM MiMoV2MTP
            Ministral3ForCausalLM MistralForCausalLM MistralForCausalLMEagle MistralLarge3ForCausalLM
            MistralLarge3ForCausalLMEagle NanbeigeForCausalLM Phi3ForCausalLM Qwen3ForCausalLM
            TeleFLMForCausalLM""",
        "inkling": """InklingForConditionalGeneration""",
        "plus_one_marks": """InternS1ProForConditionalGeneration InternS2MobiusForConditionalGeneration
            InternS2PreviewForConditionalGeneration MellumForCausalLM Qwen3MoeForCausalLM
            Qwen3MoeForCausalLMMTP Qwen3NextForCausalLM Qwen3NextForCausalLMMTP
            Qwen3VLMoeForConditionalGeneration Qwen3_5ForConditionalGeneration
            Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration""",
        "dspark_outputs": """KimiK3ForConditionalGeneration KimiK3LinearForCausalLM""",
        "as_given_marks": """Lfm2BidirectionalModel""",
        "minimax_dflash": """MiniMaxM3SparseForConditionalGeneration""",
        "as_given": """MuseGlimmerForCausalLM MuseGlimmerForConditionalGeneration""",
        "muse_spark": """MuseSparkForConditionalGeneration""",
        "plus_one_set": """NemotronHForCausalLM NemotronHForCausalLMMTP NemotronHPuzzleForCausalLM NemotronH_Nano_Omni_Reasoning_V3
            NemotronH_Nano_VL_V2 NemotronH_Omni_Reasoning_V3""",
        "qwen3_5_text": """Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM""",
    },
}
# the architectures with a set_dspark_layers_to_capture of their own, and its rule; every other architecture's
# DSPARK is its DFLASH (SGLang falls back to set_dflash_layers_to_capture)
DSPARK_OWN_RULE = {"BailingMoeV3ForCausalLM": "outputs", "DeepseekV4ForCausalLM": "dspark_outputs",
                   "DeepseekV4ForCausalLMNextN": "dspark_outputs", "KimiK3ForConditionalGeneration": "dspark_outputs",
                   "KimiK3LinearForCausalLM": "dspark_outputs", "KimiLinearForCausalLM": "dspark_outputs",
                   "MiniMaxM3SparseForConditionalGeneration": "minimax_dspark"}
DSPARK_OWN = frozenset(DSPARK_OWN_RULE)


def _dspark(dflash):
    """DSPARK's table: DFLASH's, each architecture with a method of its own under that method's rule."""
    pairs = [(a, rule) for rule, names in dflash.items() for a in names.split() if a not in DSPARK_OWN_RULE]
    out = {}
    for arch, rule in pairs + list(DSPARK_OWN_RULE.items()):
        out.setdefault(rule, []).append(arch)
    return dict((rule, " ".join(sorted(archs))) for rule, archs in out.items())


TABLE["dspark"] = _dspark(TABLE["dflash"])
# methods reached through MiniCPMV.__getattr__ (models/minicpmv.py:1770-1773) on the class config.json's version
# picks at load: not judged here (neither refused nor predicted)
DYNAMIC = frozenset("MiniCPMV MiniCPMV4_6ForConditionalGeneration MiniCPMV4_7ForConditionalGeneration".split())

# every EntryClass of sglang/srt/models/ in 0.5.23, by file (file stem: architectures), as core/trace's registry
# reads them (tests/test_layer_rules.py checks it is exactly the tree's)
_FILES = """
afmoe: AfmoeForCausalLM
apertus: ApertusForCausalLM
arcee: ArceeForCausalLM
baichuan: BaichuanForCausalLM
bailing_mm: BailingMM2NativeForConditionalGeneration BailingMMNativeForConditionalGeneration
bailing_mm_v3: BailingMoeV3VLForConditionalGeneration
bailing_moe: BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM
bailing_moe_linear: BailingMoeV2_5ForCausalLM
bailing_moe_nextn: BailingMoeForCausalLMNextN
bailing_moe_v3: BailingMoeV3ForCausalLM
beam: BeamForCausalLM
bert: BertForSequenceClassification BertModel Contriever
chatglm: ChatGLMModel
clip: CLIPModel
cohere2_moe: Cohere2MoeForCausalLM
cohere2_vision: Cohere2VisionForConditionalGeneration
commandr: Cohere2ForCausalLM CohereForCausalLM
cosmos3: Cosmos3ForConditionalGeneration
cosmos3_edge: Cosmos3EdgeForConditionalGeneration
dbrx: DbrxForCausalLM
deepseek: DeepseekForCausalLM
deepseek_janus_pro: MultiModalityCausalLM
deepseek_nextn: DeepseekV3ForCausalLMNextN
deepseek_ocr: DeepseekOCRForCausalLM
deepseek_v2: DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM
deepseek_v4: DeepseekV4ForCausalLM
deepseek_v4_dspark: DeepseekV4ForCausalLMDSpark
deepseek_v4_nextn: DeepseekV4ForCausalLMNextN
deepseek_vl2: DeepseekVL2ForCausalLM
dflash: DFlash2BeamDraftModel DFlash2DraftModel DFlashDraftModel DFlashLagunaForCausalLM MiniMaxDFlash2DraftModel
    MuseGlimmerAssistantModel
dots3: Dots3NoteForCausalLM
dots3_nextn: Dots3NoteForCausalLMNextN
dots_ocr: DotsOCRForCausalLM
dots_vlm: DotsVLMForCausalLM
dspark: DSparkDraftModel LingDSparkModel Qwen3DSparkModel
dspark_minimax: DSparkMiniMaxDraftModel
embedding_gemma2: EmbeddingGemma2Model
ernie4: Ernie4_5_ForCausalLM Ernie4_5_MoeForCausalLM
ernie45_vl: Ernie4_5_VLMoeForConditionalGeneration
ernie4_eagle: Ernie4_5_MoeForCausalLMMTP
exaone: ExaoneForCausalLM
exaone4: Exaone4ForCausalLM
exaone_moe: ExaoneMoEForCausalLM ExaoneMoeForCausalLM
exaone_moe_mtp: ExaoneMoEForCausalLMMTP
falcon_h1: FalconH1ForCausalLM
falcon_mamba: FalconMambaForCausalLM
gemma: GemmaForCausalLM
gemma2: Gemma2ForCausalLM
gemma2_reward: Gemma2ForSequenceClassification
gemma3_causal: EmbeddingGemmaModel Gemma3ForCausalLM
gemma3_mm: Gemma3ForConditionalGeneration
gemma3n_causal: Gemma3nForCausalLM
gemma3n_mm: Gemma3nForConditionalGeneration
gemma4_causal: Gemma4ForCausalLM
gemma4_diffusion: DiffusionGemmaForBlockDiffusion
gemma4_mm: Gemma4ForConditionalGeneration
gemma4_mtp: Gemma4AssistantForCausalLM Gemma4UnifiedAssistantForCausalLM
gemma4_unified: Gemma4UnifiedForConditionalGeneration
gigachat35: GigaChat35ForCausalLM
gigachat35_mtp: GigaChat35ForCausalLMNextN
glm4: Glm4ForCausalLM
glm4_moe: Glm4MoeForCausalLM GlmMoeDsaForCausalLM GlmMoeDsaForCausalLMNextN
glm4_moe_lite: Glm4MoeLiteForCausalLM
glm4_moe_lite_nextn: Glm4MoeLiteForCausalLMNextN
glm4_moe_nextn: Glm4MoeForCausalLMNextN
glm4v: Glm4vForConditionalGeneration
glm4v_moe: Glm4vMoeForConditionalGeneration
glm5_next: Glm5NextForConditionalGeneration
glm5_next_nextn: Glm5NextForConditionalGenerationNextN
glm_image_vl: GlmImageForConditionalGeneration
glm_ocr: GlmOcrForConditionalGeneration
glm_ocr_nextn: GlmOcrForConditionalGenerationNextN
glmasr: GlmAsrForConditionalGeneration
gpt2: GPT2LMHeadModel
gpt_bigcode: GPTBigCodeForCausalLM
gpt_j: GPTJForCausalLM
gpt_oss: GptOssForCausalLM
granite: GraniteForCausalLM GraniteSWAForCausalLM
granitemoe: GraniteMoeForCausalLM GraniteMoeSWAForCausalLM GraniteMoeSharedForCausalLM
granitemoehybrid: GraniteMoeHybridForCausalLM
grok: Grok1ForCausalLM Grok1ModelForCausalLM
hrm_text: HrmTextForCausalLM
hunyuan: HunYuanDenseV1ForCausalLM HunYuanMoEV1ForCausalLM
hunyuan_v3: HYV3ForCausalLM
hunyuan_v3_nextn: HYV3ForCausalLMNextN
hunyuan_v4: HYV4ForCausalLM
hunyuan_v4_nextn: HYV4ForCausalLMNextN
inkling: InklingForConditionalGeneration InklingForConditionalGenerationMTP
internlm2: InternLM2ForCausalLM
internlm2_reward: InternLM2ForRewardModel
interns1: InternS1ForConditionalGeneration
interns1pro: InternS1ProForConditionalGeneration
interns2_mobius: InternS2MobiusForConditionalGeneration
interns2preview: InternS2PreviewForConditionalGeneration
internvl: InternVLChatModel
iquest_loopcoder: IQuestLoopCoderForCausalLM
iquest_q1: IQuestQ1ForCausalLM
iquest_q1_mtp: IQuestQ1MTP
jet_nemotron: JetNemotronForCausalLM
jet_vlm: JetVLMForConditionalGeneration
kimi_k25: KimiK25ForConditionalGeneration
kimi_k25_eagle3: Eagle3DeepseekV2ForCausalLM
kimi_k3: KimiK3ForConditionalGeneration KimiK3LinearForCausalLM
kimi_linear: KimiLinearForCausalLM
kimi_vl: KimiVLForConditionalGeneration
laguna: LagunaForCausalLM
lfm2: Lfm2BidirectionalModel Lfm2ForCausalLM
lfm2_dspark: Lfm2DSparkDraftModel
lfm2_moe: Lfm2MoeForCausalLM
lfm2_vl: Lfm2VlForConditionalGeneration
lightonocr: LightOnOCRForConditionalGeneration
lilicorr: LiLiCorrDraftModel
llada2: LLaDA2MoeModelLM
llama: IQuestCoderForCausalLM InternLM3ForCausalLM LlamaForCausalLM Phi3ForCausalLM
llama4: Llama4ForCausalLM
llama_classification: LlamaForClassification
llama_eagle: LlamaForCausalLMEagle
llama_eagle3: LlamaForCausalLMEagle3
llama_embedding: LlamaEmbeddingModel MistralModel
llama_reward: LlamaForSequenceClassification LlamaForSequenceClassificationWithNormal_Weights
llava: LlavaForConditionalGeneration LlavaLlamaForCausalLM LlavaMistralForCausalLM LlavaQwenForCausalLM
llavavid: LlavaVidForCausalLM
locate_anything: LocateAnythingForConditionalGeneration
longcat_flash: LongcatFlashForCausalLM
longcat_flash_nextn: LongcatFlashForCausalLMNextN
mamba: MambaForCausalLM
mamba2: Mamba2ForCausalLM
mellum: MellumForCausalLM
midashenglm: MiDashengLMModel
mimo: MiMoForCausalLM
mimo_mtp: MiMoMTP
mimo_v2: MiMoV2FlashForCausalLM MiMoV2ForCausalLM
mimo_v2_asr: MiMoV2ASRForCausalLM
mimo_v2_nextn: MiMoV2MTP
mindspore: MindSporeForCausalLM
minicpm: MiniCPMForCausalLM MiniCPMSALAForCausalLM
minicpm3: MiniCPM3ForCausalLM
minicpmo: MiniCPMO
minicpmv: MiniCPMV MiniCPMV4_6ForConditionalGeneration MiniCPMV4_7ForConditionalGeneration
minimax_m2: MiniMaxM2ForCausalLM
minimax_m3: MiniMaxM3SparseForCausalLM
minimax_m3_vl: MiniMaxM3SparseForConditionalGeneration
ministral3: Ministral3ForCausalLM
mistral: Mistral3ForConditionalGeneration MistralForCausalLM
mistral_eagle: MistralForCausalLMEagle
mistral_large_3: MistralLarge3ForCausalLM
mistral_large_3_eagle: MistralLarge3ForCausalLMEagle
mixtral: MixtralForCausalLM
mixtral_quant: QuantMixtralForCausalLM
mllama: MllamaForConditionalGeneration
mllama4: Llama4ForConditionalGeneration
moss_vl: MossVLForConditionalGeneration
muse_glimmer: MuseGlimmerForCausalLM MuseGlimmerForConditionalGeneration
muse_spark_omni: MuseSparkForConditionalGeneration
nanbeige: NanbeigeForCausalLM NanbeigeForSequenceClassification
nano_nemotron_vl: NemotronH_Nano_Omni_Reasoning_V3 NemotronH_Nano_VL_V2 NemotronH_Omni_Reasoning_V3
nemotron_h: NemotronHForCausalLM NemotronHPuzzleForCausalLM
nemotron_h_mtp: NemotronHForCausalLMMTP
nemotron_nas: DeciLMForCausalLM
nvila: NVILAForConditionalGeneration
nvila_lite: NVILALiteForConditionalGeneration
olmo: OlmoForCausalLM
olmo2: Olmo2ForCausalLM
olmoe: OlmoeForCausalLM
opt: OPTForCausalLM
orion: OrionForCausalLM
paddleocr_vl: PaddleOCRVLForConditionalGeneration
persimmon: PersimmonForCausalLM
phi: PhiForCausalLM
phi3_small: Phi3SmallForCausalLM
phi4mm: Phi4MMForCausalLM
phimoe: PhiMoEForCausalLM
pixtral: PixtralForConditionalGeneration PixtralVisionModel
points_v15_chat: POINTSV15ChatModel
qwen: QWenLMHeadModel
qwen2: Qwen2ForCausalLM
qwen2_5_vl: Qwen2_5_VLForConditionalGeneration
qwen2_audio: Qwen2AudioForConditionalGeneration
qwen2_classification: Qwen2ForSequenceClassification
qwen2_eagle: Qwen2ForCausalLMEagle
qwen2_moe: Qwen2MoeForCausalLM
qwen2_rm: Qwen2ForRewardModel
qwen2_vl: Qwen2VLForConditionalGeneration
qwen3: Qwen3ForCausalLM
qwen3_5: Qwen3_5ForConditionalGeneration Qwen3_5MoeForConditionalGeneration
qwen3_5_mtp: Qwen3_5ForCausalLMMTP
qwen3_5_text: Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM
qwen3_asr: Qwen3ASRForConditionalGeneration
qwen3_classification: Qwen3ForSequenceClassification
qwen3_embedding: Qwen3Model
qwen3_moe: Qwen3MoeForCausalLM
qwen3_moe_mtp: Qwen3MoeForCausalLMMTP
qwen3_next: Qwen3NextForCausalLM
qwen3_next_mtp: Qwen3NextForCausalLMMTP
qwen3_omni_moe: Qwen3OmniMoeForConditionalGeneration
qwen3_rm: Qwen3ForRewardModel
qwen3_vl: Qwen3VLForConditionalGeneration
qwen3_vl_moe: Qwen3VLMoeForConditionalGeneration
qwen4_exp: Qwen4ExpForConditionalGeneration
qwen4_exp_mtp: Qwen4ExpForCausalLMMTP
roberta: XLMRobertaForSequenceClassification XLMRobertaModel
sarashina2_vision: Sarashina2VisionForCausalLM
sarvam_moe: SarvamMLAForCausalLM SarvamMoEForCausalLM
sdar: SDARForCausalLM
sdar_moe: SDARMoeForCausalLM
solar: SolarForCausalLM
spark2_5: Spark2_5ForCausalLM
stablelm: StableLmForCausalLM
starcoder2: Starcoder2ForCausalLM
step3_vl: Step3VLForConditionalGeneration
step3_vl_10b: StepVLForConditionalGeneration
step3p5: Step3p5ForCausalLM
step3p5_mtp: Step3p5MTP
step3p7: Step3p7ForConditionalGeneration
teleflm: TeleFLMForCausalLM
torch_native_llama: TorchNativeLlamaForCausalLM TorchNativePhi3ForCausalLM
transformers: TransformersEmbeddingModel TransformersForCausalLM TransformersForSequenceClassification
    TransformersMoEEmbeddingModel TransformersMoEForCausalLM TransformersMoEForSequenceClassification
    TransformersMultiModalEmbeddingModel TransformersMultiModalForCausalLM
    TransformersMultiModalForSequenceClassification TransformersMultiModalMoEEmbeddingModel
    TransformersMultiModalMoEForCausalLM TransformersMultiModalMoEForSequenceClassification
unlimited_ocr: UnlimitedOCRForCausalLM
voxtral: VoxtralForConditionalGeneration
whisper: WhisperForConditionalGeneration
xllm: K2HorizonForCausalLM XllmForCausalLM
xverse: XverseForCausalLM
xverse_moe: XverseMoeForCausalLM
yivl: YiVLForCausalLM
zaya: ZayaForCausalLM
"""
ARCH_FILES = dict(("%s" % a, "models/%s.py" % line.split(":")[0].strip())
                  for line in " ".join(_FILES.split("\n    ")).strip().splitlines() for a in line.split(":")[1].split())
