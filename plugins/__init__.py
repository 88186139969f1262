"""TensorRT plugins of mla-deploy (source tree only; see ``mla_deploy.trt.plugin_loader``)."""
